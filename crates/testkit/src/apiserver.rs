//! A fake Kubernetes API server with faithful list/watch semantics.
