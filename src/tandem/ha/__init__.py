"""Failover logic, pure: model, ranking, the decision function, fencing rules (to come)."""
