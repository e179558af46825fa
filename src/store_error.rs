//! The error every store role returns. It sits below the roles so that each domain
//! module can own its role trait without depending on the backends that implement it.

/// The cause a store error keeps: the client's own error, or a message where the client
/// had none.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A store operation failed. Each variant but `Fenced` keeps its cause as `source`.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unreachable: {what}: {source}")]
    Unreachable {
        /// The store and what was being done, e.g. `redis GET`.
        what: String,
        #[source]
        source: BoxError,
    },
    /// The client refused its settings (a malformed URL, a file it cannot read): no
    /// retry helps until the config changes.
    #[error("store {store} settings refused: {source}")]
    Settings {
        store: String,
        #[source]
        source: BoxError,
    },
    #[error("store operation {operation} failed: {source}")]
    Operation {
        operation: &'static str,
        #[source]
        source: BoxError,
        /// Whether the same call may succeed later (a server loading its data, a
        /// failover under way), or is refused the same way every time (no permission for
        /// the command, a value that cannot be encoded).
        retryable: bool,
    },
    #[error("stored value under {key} is corrupt: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: BoxError,
    },
    /// The writer's lease was taken with a newer token: it is no longer the holder.
    #[error("write refused: lease {lease} has a newer holder than token {token}")]
    Fenced { lease: String, token: u64 },
}

/// The class of a [`StoreError`], for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    Unreachable,
    Settings,
    Operation,
    Corrupt,
    Fenced,
}

impl StoreError {
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            Self::Unreachable { .. } => StoreErrorKind::Unreachable,
            Self::Settings { .. } => StoreErrorKind::Settings,
            Self::Operation { .. } => StoreErrorKind::Operation,
            Self::Corrupt { .. } => StoreErrorKind::Corrupt,
            Self::Fenced { .. } => StoreErrorKind::Fenced,
        }
    }

    /// Whether the same call may succeed later: the store came back, a transient error
    /// passed. A corrupt value or a lost lease stays as it is.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Unreachable { .. } => true,
            Self::Operation { retryable, .. } => *retryable,
            Self::Settings { .. } | Self::Corrupt { .. } | Self::Fenced { .. } => false,
        }
    }
}
