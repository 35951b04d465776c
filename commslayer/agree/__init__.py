"""Agreement and the job's store: who belongs to a communicator's next
generation (membership) and the rules of that decision (agreement), where a
communicator's store comes from and how every call on it is bounded (store),
and a store on an etcd cluster (etcdstore).  It may import only the base
modules at the package root.
"""
