"""The Flower bridge (optional extra `jfed[flower]`): jfed's methods on real separate clients.

`transport` carries client training to Flower SuperNodes behind the `GroupTrainer` interface;
`server_app` is the ServerApp (jfed's driver with that transport), `client_app` the ClientApp (a
node's share of the clients, trained by jfed's engine in the node's long-lived `worker`, which
`relay` starts and talks to); `settings` reads the run config both get; `deploy` starts a
local deployment.
"""
