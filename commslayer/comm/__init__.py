"""The communicator and its op path: ``Communicator``, its ops (collectives,
point-to-point, batches, the ring), their ``Work`` and deadlines (work,
watchdog), the checks an op runs before it sends (validation, check mode,
the NaN check, write isolation), each generation's lifecycle, how Gloo and
NCCL groups are built and classified (backends), the direct path in native
code, the c10d ``ProcessGroup`` a communicator is seen as, and how a process
ends (exits).  It may import failure detection (``commslayer.detect``), the
store and agreement (``commslayer.agree``) and the base modules at the
package root, never the adapter, training or the launcher above it.
"""
