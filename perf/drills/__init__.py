"""Drills: the deployment run long (soak) or hurt on purpose (chaos, failover) under load."""
