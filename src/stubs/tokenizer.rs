#![allow(missing_docs, dead_code)]
use crate::error::Result;
use crate::loader::gguf::GgufFile;
pub trait Tokenizer: Send + Sync + 'static {
    fn encode(&self, text: &str, bos: bool, eos: bool) -> Result<Vec<u32>>;
    fn decode(&self, ids: &[u32]) -> Result<String>;
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>>;
    fn vocab_size(&self) -> usize;
    fn bos_id(&self) -> Option<u32>;
    fn eos_id(&self) -> Option<u32>;
    fn stop_ids(&self) -> &[u32];
    fn add_bos_by_default(&self) -> bool;
    fn chat_format(&self) -> Option<ChatFormat>;
}
#[derive(Debug, Default)]
pub struct StreamDecoder;
impl StreamDecoder { pub fn new() -> Self { Self } pub fn push<T: Tokenizer + ?Sized>(&mut self, _t: &T, _id: u32) -> String { todo!() } pub fn finish(&mut self) -> String { todo!() } }
#[derive(Debug)]
pub struct GgufBpeTokenizer;
impl GgufBpeTokenizer { pub fn from_gguf(_g: &GgufFile) -> Result<Self> { todo!() } }
#[derive(Debug)]
pub struct HfTokenizer;
impl HfTokenizer { pub fn from_dir(_d: &std::path::Path) -> Result<Self> { todo!() } }

#[derive(Debug, Clone, Copy)]
pub enum ChatFormat { ChatMl }
impl ChatFormat { pub fn format(&self, _m: &[ChatMessage], _g: bool) -> String { todo!() } }
pub struct ChatMessage;
impl ChatMessage { pub fn user(_s: &str) -> Self { Self } pub fn assistant(_s: &str) -> Self { Self } }

macro_rules! stub_impl { ($t:ty) => { impl Tokenizer for $t {
    fn encode(&self, _: &str, _: bool, _: bool) -> Result<Vec<u32>> { todo!() }
    fn decode(&self, _: &[u32]) -> Result<String> { todo!() }
    fn token_bytes(&self, _: u32) -> Option<Vec<u8>> { todo!() }
    fn vocab_size(&self) -> usize { todo!() }
    fn bos_id(&self) -> Option<u32> { todo!() }
    fn eos_id(&self) -> Option<u32> { todo!() }
    fn stop_ids(&self) -> &[u32] { todo!() }
    fn add_bos_by_default(&self) -> bool { todo!() }
    fn chat_format(&self) -> Option<ChatFormat> { todo!() }
} } }
stub_impl!(GgufBpeTokenizer);
stub_impl!(HfTokenizer);
