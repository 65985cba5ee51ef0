"""The trajectory server (groups, partial trajectories, the request queue, the audit) and the parameter server
(versioned weights)."""
