//! The model: Kubernetes objects turned into proxy concepts (service ports, endpoints). Pure.
