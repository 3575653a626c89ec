"""What both gRPC services share: server bootstrap, error mapping, feature messages."""
