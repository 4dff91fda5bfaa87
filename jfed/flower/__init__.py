"""The Flower bridge (optional extra `jfed[flower]`): jfed's methods on real separate clients.

`transport` carries client training to Flower SuperNodes behind the `GroupTrainer` interface;
`apps` holds the ServerApp (jfed's driver with that transport) and the ClientApp (a node's
share of the clients, trained by jfed's engine); `deploy` starts a local deployment.
"""
