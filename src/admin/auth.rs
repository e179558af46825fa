//! Bearer-token check for the protected routes.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{AdminState, ApiError};

pub(super) async fn require_token(
    State(state): State<AdminState>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(expected) = &state.token {
        let given = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.as_bytes(), expected.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(request).await
}

/// Compares without stopping at the first difference, so timing does not reveal how much
/// of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::same;

    #[test]
    fn tokens_compare_exactly() {
        assert!(same(b"s3cret", b"s3cret"));
        assert!(!same(b"s3cret", b"s3cres"));
        assert!(!same(b"s3cret", b"s3cret!"));
        assert!(!same(b"", b"x"));
    }
}
