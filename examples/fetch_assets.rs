//! Fetches the demo model (and, with `--features llama3`, the Llama 3 tokenizer) into the
//! cache directory, so later runs and tests work offline.
//!
//! ```sh
//! cargo run --release --example fetch_assets
//! ```

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = llama_burn::demo::demo_model_path()?;
    println!("demo model: {}", model.display());
    let tokenizer = llama_burn::demo::fetch_wheel_file(
        "llama-models",
        "0.3.0",
        "llama_models/llama3/tokenizer.model",
    )?;
    println!("llama 3 tokenizer: {}", tokenizer.display());
    Ok(())
}
