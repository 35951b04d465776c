"""The fault-injection harness: scripted faults against a real job, and what survived."""
