//! Tenants sharing one broker and one store, kept apart by qualified names.
//!
//! A tenant's graph, workflow or schedule `x` is `tenant/x` (its key: in the store, in
//! metrics and in the admin API); each topic it uses is `tenant.<topic>` (outputs,
//! sources, cron ticks, workflow starts, executor and results topics); its task
//! namespaces begin with the tenant. Without a tenant, names and topics are left as
//! they are and namespaces begin with [`PUBLIC`].

/// The first segment of a task namespace that belongs to no tenant.
pub const PUBLIC: &str = "public";

/// `tenant/name`, or `name` without a tenant.
pub fn key(tenant: Option<&str>, name: &str) -> String {
    match tenant {
        Some(tenant) => format!("{tenant}/{name}"),
        None => name.to_string(),
    }
}

/// `tenant.topic`, or `topic` without a tenant.
pub fn topic(tenant: Option<&str>, topic: &str) -> String {
    match tenant {
        Some(tenant) => format!("{tenant}.{topic}"),
        None => topic.to_string(),
    }
}

/// The tenant a key belongs to (`acme/report` → `acme`), if any.
pub fn of_key(key: &str) -> Option<&str> {
    key.split_once('/').map(|(tenant, _)| tenant)
}

/// The tenant of a namespace's first segment (`None` for [`PUBLIC`]).
pub fn of_namespace_segment(segment: &str) -> Option<&str> {
    (segment != PUBLIC).then_some(segment)
}

/// Why a tenant name cannot be used, if it cannot: it is a topic segment, a key prefix
/// and a namespace segment, so it holds letters, digits, `_` and `-` only, and is not
/// the namespace of tenant-less tasks.
pub fn check(tenant: &str) -> Result<(), String> {
    if tenant.is_empty()
        || !tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
    {
        return Err(format!(
            "tenant {tenant:?} must be letters, digits, '_' and '-' only"
        ));
    }
    if tenant == PUBLIC {
        return Err(format!(
            "tenant {PUBLIC:?} is reserved for what belongs to no tenant"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_topics_are_qualified_only_with_a_tenant() {
        assert_eq!(key(Some("acme"), "report"), "acme/report");
        assert_eq!(key(None, "report"), "report");
        assert_eq!(topic(Some("acme"), "weir.results"), "acme.weir.results");
        assert_eq!(topic(None, "weir.results"), "weir.results");
        assert_eq!(of_key("acme/report"), Some("acme"));
        assert_eq!(of_key("report"), None);
        assert_eq!(of_namespace_segment("public"), None);
        assert_eq!(of_namespace_segment("acme"), Some("acme"));
    }

    #[test]
    fn tenant_names_are_plain_segments() {
        assert!(check("acme-eu_1").is_ok());
        for bad in ["", "a.b", "a/b", "a::b", "a b", "public"] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
    }
}
