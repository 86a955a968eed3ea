"""The Kubernetes adapters: `discovery/` (EndpointSlices -> endpoints) and `control/` (RoutingPolicy custom
resources -> policies, with their status written back). Both import the Kubernetes client only when
configured."""
