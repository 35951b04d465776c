"""``commslayer-run``, the launcher: its arguments and their checks, which need
no torch (launcher), what it does once they pass (launch), per-rank
supervision (supervisor), the warm spares it keeps (spares) and the set of
processes a job is (processes).  It sits above every other part of the
package and may import any of them.
"""
