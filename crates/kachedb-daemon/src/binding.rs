//! Tenants bound to uids and gids (`kachedb serve --tenant-uid NAME=UID,…`,
//! `--tenant-gid NAME=GID,…`; docs/tenants.md): which tenant an admitted
//! peer acts as, decided once, at its hello, from the credentials the kernel
//! recorded when it connected.
//!
//! A peer *matches* a bound tenant when its uid is one of the tenant's uids,
//! or its primary gid or one of its supplementary groups is one of the
//! tenant's gids. Then:
//!
//! * naming a bound tenant: admitted as it if the peer matches it, else refused;
//! * naming an unbound tenant: admitted as it if the peer matches no bound
//!   tenant, else refused (a bound peer is counted where its operator put it);
//! * naming none (or [`DEFAULT_TENANT`]): the one bound tenant it matches,
//!   the default tenant if it matches none, refused if it matches several
//!   (it has to say which).
//!
//! Binding admits nobody: a peer must first be admitted (the daemon's uid or
//! `--allow-gid`, [`crate::control::Access`]).

use kachedb_shm::control::DEFAULT_TENANT;

/// One tenant bound to uids and gids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantBinding {
    /// The tenant's name (a `kachedb_shm::control::check_tenant_name` name,
    /// never the default tenant).
    pub name: String,
    /// Peers with one of these uids act as it (`--tenant-uid`).
    pub uids: Vec<u32>,
    /// Peers with one of these gids, primary or supplementary, act as it (`--tenant-gid`).
    pub gids: Vec<u32>,
}

impl TenantBinding {
    /// Whether a peer of `uid` in groups `gids` (primary and supplementary) is one of its.
    pub fn matches(&self, uid: u32, gids: &[u32]) -> bool {
        self.uids.contains(&uid) || gids.iter().any(|g| self.gids.contains(g))
    }
}

/// A peer's credentials as the control socket recorded them at connect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerIds {
    /// Effective uid (`SO_PEERCRED`).
    pub uid: u32,
    /// Effective gid (`SO_PEERCRED`).
    pub gid: u32,
    /// Supplementary groups (`SO_PEERGROUPS`); empty where the kernel does
    /// not report them (before Linux 4.13): then only `gid` is matched.
    pub groups: Vec<u32>,
}

impl PeerIds {
    /// The primary gid and the supplementary groups.
    fn gids(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.gid).chain(self.groups.iter().copied())
    }
}

/// The tenant a peer with `ids`, naming `named` in its hello, acts as under
/// `bindings`: `Ok(None)` the default tenant, `Ok(Some(name))` that tenant,
/// `Err` the reason to refuse it, for the peer (what to do).
pub fn tenant_for(bindings: &[TenantBinding], ids: &PeerIds, named: Option<&str>) -> Result<Option<String>, String> {
    let named = named.filter(|n| *n != DEFAULT_TENANT);
    if bindings.is_empty() {
        return Ok(named.map(str::to_owned));
    }
    let gids: Vec<u32> = ids.gids().collect();
    let mine: Vec<&str> = bindings.iter().filter(|b| b.matches(ids.uid, &gids)).map(|b| b.name.as_str()).collect();
    let who = || {
        let mut g = gids.clone();
        g.sort_unstable();
        g.dedup();
        let g: Vec<String> = g.iter().map(u32::to_string).collect();
        format!("uid {} (groups {})", ids.uid, g.join(","))
    };
    match named {
        Some(n) if mine.contains(&n) => Ok(Some(n.to_owned())),
        Some(n) if bindings.iter().any(|b| b.name == n) => Err(format!(
            "tenant {n:?} is bound to other users or groups (kachedb serve --tenant-uid/--tenant-gid) and {} is not one of them: connect as one of its users, name {}, or ask the daemon's operator to bind {n:?} to you",
            who(),
            match mine.as_slice() {
                [] => "an unbound tenant or none".to_owned(),
                [one] => format!("your own tenant {one:?} (or none)"),
                many => format!("one of your tenants {}", quoted(many)),
            }
        )),
        Some(n) if !mine.is_empty() => Err(format!(
            "{} is bound to tenant {} (kachedb serve --tenant-uid/--tenant-gid) and may act as no other: name {} instead of {n:?}",
            who(),
            quoted(&mine),
            if mine.len() == 1 { "it, or none" } else { "one of them" }
        )),
        Some(n) => Ok(Some(n.to_owned())),
        None => match mine.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some((*one).to_owned())),
            many => Err(format!(
                "{} is bound to several tenants ({}; kachedb serve --tenant-uid/--tenant-gid): name one of them in the hello (Python: kachedb.connect(tenant=…))",
                who(),
                quoted(many)
            )),
        },
    }
}

/// `"a", "b"`.
fn quoted(names: &[&str]) -> String {
    names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(name: &str, uids: &[u32], gids: &[u32]) -> TenantBinding {
        TenantBinding { name: name.into(), uids: uids.to_vec(), gids: gids.to_vec() }
    }

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> PeerIds {
        PeerIds { uid, gid, groups: groups.to_vec() }
    }

    #[test]
    fn without_bindings_a_peer_is_the_tenant_it_names() {
        assert_eq!(tenant_for(&[], &peer(5, 5, &[]), Some("x")), Ok(Some("x".into())));
        assert_eq!(tenant_for(&[], &peer(5, 5, &[]), None), Ok(None));
        assert_eq!(tenant_for(&[], &peer(5, 5, &[]), Some(DEFAULT_TENANT)), Ok(None));
    }

    #[test]
    fn a_bound_tenant_admits_only_its_uids_and_groups() {
        let b = [bind("team-a", &[1001], &[]), bind("team-g", &[], &[700])];
        assert_eq!(tenant_for(&b, &peer(1001, 1001, &[]), Some("team-a")), Ok(Some("team-a".into())));
        let e = tenant_for(&b, &peer(1002, 1002, &[]), Some("team-a")).unwrap_err();
        assert!(e.contains("\"team-a\" is bound") && e.contains("uid 1002"), "{e}");
        // By primary gid, or by a supplementary group.
        assert_eq!(tenant_for(&b, &peer(9, 700, &[]), Some("team-g")), Ok(Some("team-g".into())));
        assert_eq!(tenant_for(&b, &peer(9, 9, &[3, 700]), Some("team-g")), Ok(Some("team-g".into())));
        assert!(tenant_for(&b, &peer(9, 9, &[3]), Some("team-g")).is_err());
        // Unbound tenants stay open to peers bound to nothing.
        assert_eq!(tenant_for(&b, &peer(9, 9, &[]), Some("scratch")), Ok(Some("scratch".into())));
        assert_eq!(tenant_for(&b, &peer(9, 9, &[]), None), Ok(None));
    }

    #[test]
    fn a_bound_peer_acts_only_as_its_tenant() {
        let b = [bind("team-a", &[1001], &[]), bind("team-b", &[1002], &[])];
        // Another bound tenant, or an unbound one: refused, naming its own.
        let e = tenant_for(&b, &peer(1001, 1001, &[]), Some("team-b")).unwrap_err();
        assert!(e.contains("your own tenant \"team-a\""), "{e}");
        let e = tenant_for(&b, &peer(1001, 1001, &[]), Some("scratch")).unwrap_err();
        assert!(e.contains("bound to tenant \"team-a\"") && e.contains("\"scratch\""), "{e}");
        // None, or the default tenant by name: its own.
        assert_eq!(tenant_for(&b, &peer(1001, 1001, &[]), None), Ok(Some("team-a".into())));
        assert_eq!(tenant_for(&b, &peer(1001, 1001, &[]), Some(DEFAULT_TENANT)), Ok(Some("team-a".into())));
    }

    #[test]
    fn a_peer_of_several_bound_tenants_names_one() {
        let b = [bind("team-a", &[1001], &[]), bind("team-g", &[], &[700])];
        let p = peer(1001, 1001, &[700]);
        assert_eq!(tenant_for(&b, &p, Some("team-a")), Ok(Some("team-a".into())));
        assert_eq!(tenant_for(&b, &p, Some("team-g")), Ok(Some("team-g".into())));
        let e = tenant_for(&b, &p, None).unwrap_err();
        assert!(e.contains("several tenants (\"team-a\", \"team-g\""), "{e}");
        assert!(tenant_for(&b, &p, Some("scratch")).unwrap_err().contains("one of them"));
    }
}
