"""Failure detection: each communicator's members watch each other over their
own TCP links (liveness), who watches whom and when a member counts as lost
(watch), a simulator of that protocol at scale (watchsim), and which address
each rank is reached at (addresses).  It may import the store and agreement
(``commslayer.agree``) and the base modules at the package root.
"""
