"""The conformance kit: a head client with bounded waits (`head`), a scenario suite anyone can
point at a node, ours or the Rust one (`suite`, `superfluid-conformance`), the fleet mock's
algorithm from its spec (`reference`), Link F transcripts recorded by `superfluid-noded
--record` and replayed against another node (`transcript`, `replay`), and a small client for
people (`superfluid-client`).

The kit speaks to a node only over the wire: it never imports the node's agent or engine.
"""
