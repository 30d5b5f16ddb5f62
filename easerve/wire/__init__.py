"""The wire format: tensor frame codec, proto <-> domain conversion, and the generated easerve.v1 stubs (v1/)."""
