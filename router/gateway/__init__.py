"""The gateway data path: fleetroute as the endpoint picker (Envoy ext_proc) of the Gateway API Inference
Extension. Envoy moves the bytes; the routing core (router/server/route.py) decides, as it does behind the proxy."""
