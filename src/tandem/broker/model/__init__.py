"""The AMQP model: vhosts, users, exchanges, queues, bindings, routing. Pure: no I/O."""
