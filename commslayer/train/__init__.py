"""Resilient training, behind ``commslayer.resilience``: the job of replica
groups (job) and the replicate dimension it keeps alive (replicas), a step's
gradients averaged across groups (gradients), the job without replica groups
whose ranks hold each other's state (peerjob, redundancy), a rank's state as
bytes (packing), a sharded state moved to another number of ranks (reshard),
how a bug is told from a fault (failures), and a warm spare waiting for a
lost rank (spare).  It may import everything below it: the c10d adapter, the
communicator, detection, agreement and the base modules.
"""
