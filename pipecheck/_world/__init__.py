"""The world layer: worker processes, rendezvous, faults and their records, the shared pool (`World`)."""
