"""The broker node: protocol, model, store, server and admin API."""
