"""Generated protobuf packages; see nibble.proto.generate."""
