//! Test kit: fake Kubernetes API server, netns helpers, fixtures.
