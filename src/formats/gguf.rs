//! GGUF reader.
