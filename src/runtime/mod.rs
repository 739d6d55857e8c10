//! Everything between a user's text and the models: tokenizer, prompts, the embedding batcher,
//! model resolution.

pub mod embed;
pub mod resolve;
pub mod tokenizer;
