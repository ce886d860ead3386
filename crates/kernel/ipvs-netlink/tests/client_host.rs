//! Unprivileged client behaviour on the host kernel (which has no IPVS on this project's
//! machines): the family lookup must report a clean `FamilyMissing`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use ipvs_netlink::{Client, Error};

#[test]
fn client_reports_family_missing_without_ipvs() {
    let r = Client::new();
    if Path::new("/proc/net/ip_vs").exists() {
        // IPVS is loaded here: the family must resolve.
        assert!(
            r.is_ok(),
            "IPVS is loaded but Client::new failed: {:?}",
            r.err()
        );
    } else if !Path::new("/proc/modules").exists() {
        // No IPVS and no loadable modules: nothing can register the family.
        match r {
            Err(Error::FamilyMissing) => {}
            Err(e) => panic!("expected FamilyMissing, got {e:?}"),
            Ok(_) => panic!("IPVS family resolved on a kernel without IPVS"),
        }
    } else {
        // A modular kernel may autoload ip_vs on lookup: either outcome, but no other error.
        assert!(
            matches!(r, Ok(_) | Err(Error::FamilyMissing)),
            "unexpected error: {:?}",
            r.err()
        );
    }
}
