"""embedcar-client: the sidecar's Python client (embedcar_client.client), its result types, the error
types and code table, the wire names and the generated stubs (embedcar_client.proto).

Nothing is imported here: the server's lowest floor imports embedcar_client.errors without loading
grpc or numpy."""
