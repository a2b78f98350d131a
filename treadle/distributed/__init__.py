"""Scale-out on Ray: engine replicas behind one front end (docs/replicas.md)."""
