//! The static directory source: Services, EndpointSlices and Nodes read from YAML files.
