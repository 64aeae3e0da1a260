"""Layer 1, the network: the wire format and its sealing, the control channel, the rendezvous
store only members can use, weight-sync process groups and gloo's listener, the one-sided
peer transport interface, and blocking calls run off the event loop. Imports only
:mod:`weightsync_core.api` below it, and no Ray."""
