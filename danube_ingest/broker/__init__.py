"""The Danube gRPC protocol server: services, topic management, conversions and errors."""
