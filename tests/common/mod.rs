//! Helpers shared by the end-to-end tests on the embedded backends.
#![allow(dead_code)]

#[cfg(feature = "it")]
pub mod certs;
#[cfg(feature = "it")]
pub mod nodes;
#[cfg(feature = "it")]
pub mod servers;
#[cfg(feature = "it")]
pub mod services;

#[allow(unused_imports)]
pub use weir::testing::{eventually, settle, TestDriver as Harness};
