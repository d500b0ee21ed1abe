//! `markbase pull`: fetch the default model into the cache.

use anyhow::Result;
use markbase_engine::pull;

/// Pulls the default model (if needed) and prints its path.
pub fn run() -> Result<()> {
    let path = pull::default_model_location()?;
    if path.is_file() {
        println!("{} (already pulled)", path.display());
        return Ok(());
    }
    let path = crate::model::pull_default()?;
    println!("{}", path.display());
    Ok(())
}
