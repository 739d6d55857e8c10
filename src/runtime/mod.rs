//! Everything between a user's text and the models: tokenizer, prompts and chat templates, the
//! embedding batcher, the sampler and generation loop, model resolution.

pub mod chat_template;
pub mod embed;
pub mod generate;
pub mod resolve;
pub mod sampler;
pub mod tokenizer;
