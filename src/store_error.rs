//! The error every store role returns. It sits below the roles so that each domain
//! module can own its role trait without depending on the backends that implement it.

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unreachable: {0}")]
    Unreachable(String),
    #[error("store operation {operation} failed: {reason}")]
    Operation {
        operation: &'static str,
        reason: String,
    },
    #[error("stored value under {key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
    /// The writer's lease was taken with a newer token: it is no longer the holder.
    #[error("write refused: lease {lease} has a newer holder than token {token}")]
    Fenced { lease: String, token: u64 },
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unreachable(_) | Self::Operation { .. })
    }
}
