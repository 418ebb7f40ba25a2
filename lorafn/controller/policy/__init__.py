"""Pure policy of the controller: no torch, no Kubernetes, no Redis."""
