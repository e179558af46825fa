//! The `weir` binary: the application layer ([`app`]) over the weir library.

mod app;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: weir::allocator::Allocator = weir::allocator::Allocator;

#[tokio::main]
async fn main() {
    if let Some(status) = app::main(app::cli::Cli::parse()).await {
        std::process::exit(status);
    }
}
