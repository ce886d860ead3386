//! The control plane's certificates: a CA, the apiserver's serving certificate and the
//! service-account key pair, made with `openssl`.

use super::*;

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    run_ok(Command::new("openssl").args(args).current_dir(dir), None).map(|_| ())
}

/// Writes the CA, the serving certificate (for loopback, the test VM's forwarded address and
/// the in-cluster names) and the service-account key pair into `dir`.
pub(super) fn make_certs(dir: &Path) -> Result<()> {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut ca = vec!["req", "-x509", "-nodes", "-days", "3"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=kube-ipvs-test-ca",
    ]);
    openssl(dir, &ca)?;
    let mut csr = vec!["req", "-new", "-nodes"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=kube-apiserver",
    ]);
    openssl(dir, &csr)?;
    io_ctx(
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,IP:10.0.2.100,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc\n\
             extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
             basicConstraints=critical,CA:FALSE\n",
        ),
        || "writing server.ext".into(),
    )?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3",
            "-out",
            "server.crt",
            "-extfile",
            "server.ext",
        ],
    )?;
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "sa.key",
        ],
    )?;
    openssl(dir, &["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"])
}
