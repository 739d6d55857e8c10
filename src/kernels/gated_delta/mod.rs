//! The gated-delta (Gated DeltaNet) kernel family.
