"""The control plane: quorum rules, recovery plan, lighthouse (state, server, HTTP, client),
manager server and client, gRPC plumbing and the protocol (DESIGN.md sections 4-6)."""
