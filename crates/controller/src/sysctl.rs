//! Kernel sysctls the proxy needs (IPVS conntrack, expire_nodest_conn, conn_reuse_mode, strict ARP).
