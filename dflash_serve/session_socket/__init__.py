"""The local session socket (protos/session_socket.proto): RunSession without gRPC on one host."""
