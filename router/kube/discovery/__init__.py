"""Endpoint discovery: where the router learns which inference engines exist.

The static `endpoints:` list of the config is always part of the endpoint set. A dynamic source joins its
endpoints to it and hands the union to `Balancer.set_endpoints` whenever something routable changes:

- `kubernetes` (router.kube.discovery.kubernetes): the EndpointSlices of a Service, listed and watched through
  the Kubernetes API, with each endpoint's ready/serving/terminating conditions;
- or, with `inferencePool:` (router.kube.discovery.inference_pool), the Pods a Gateway API Inference Extension
  InferencePool selects, one endpoint per target port.

A source only reports membership and its own view of each endpoint's state (serving or draining); health,
telemetry and operator drains are joined with it by the balancer when it builds a snapshot.
"""
