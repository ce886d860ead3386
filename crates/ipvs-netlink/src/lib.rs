//! IPVS generic netlink codec and client.
