"""The Kubernetes operator (issue 6): the BrokerCluster resource, and in time the kopf
handlers, builders and adapters that run the `tandem.ha` loop on a Lease."""
