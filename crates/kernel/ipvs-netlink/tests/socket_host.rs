//! The netlink socket's receive time limit on the host kernel (unprivileged): a request the
//! kernel never answers fails with a typed timeout instead of blocking for good, on both
//! protocols the workspace speaks, and the socket keeps working afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use ipvs_netlink::codec::netlink::{decode_family_id, put_get_family};
use ipvs_netlink::Error;
use netlink::consts::{NLMSG_NOOP, NLM_F_REQUEST};
use netlink::{put_message, Socket, SocketProtocol, DEFAULT_RECV_TIMEOUT};

const LIMIT: Duration = Duration::from_millis(300);

/// Sends a request the kernel handles silently: a control message (`NLMSG_NOOP`) without
/// `NLM_F_ACK` gets no reply at all (`netlink_rcv_skb` skips it and acks only on request).
fn send_unanswered(sock: &mut Socket) -> u32 {
    let seq = sock.next_seq();
    put_message(sock.buf(), NLMSG_NOOP, NLM_F_REQUEST, seq, &[], |_| {});
    sock.send().unwrap();
    seq
}

fn unanswered_request_times_out(protocol: SocketProtocol) {
    let mut sock = Socket::connect(protocol, 64 * 1024).unwrap();
    assert_eq!(sock.recv_timeout(), DEFAULT_RECV_TIMEOUT);
    sock.set_recv_timeout(LIMIT).unwrap();
    assert_eq!(sock.recv_timeout(), LIMIT);
    let seq = send_unanswered(&mut sock);
    let err = sock
        .recv_replies::<Error>(seq, |_| panic!("the kernel answered a NOOP"))
        .unwrap_err();
    match &err {
        Error::Timeout { what, after } => {
            assert_eq!(*what, "recv");
            assert_eq!(*after, LIMIT);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(err.is_timeout());
    assert!(
        err.to_string()
            .contains("no answer from the kernel within 300ms"),
        "{err}"
    );
    // A plain receive with nothing queued times out the same way.
    assert!(sock.recv().unwrap_err().is_timeout());
    // A non-blocking receive still says "nothing queued", not "timed out".
    let e = sock.try_recv().unwrap_err();
    assert!(
        matches!(&e, netlink::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::WouldBlock),
        "{e:?}"
    );
}

#[test]
fn generic_netlink_request_without_answer_times_out() {
    unanswered_request_times_out(SocketProtocol::Generic);
}

#[test]
fn netfilter_netlink_request_without_answer_times_out() {
    unanswered_request_times_out(SocketProtocol::Netfilter);
}

#[test]
fn socket_answers_again_after_a_timeout() {
    let mut sock = Socket::connect(SocketProtocol::Generic, 64 * 1024).unwrap();
    sock.set_recv_timeout(LIMIT).unwrap();
    let seq = send_unanswered(&mut sock);
    assert!(sock
        .recv_replies::<Error>(seq, |_| Ok(()))
        .unwrap_err()
        .is_timeout());
    // The generic netlink controller itself is always registered: its lookup is answered.
    let seq = sock.next_seq();
    put_get_family(sock.buf(), seq, "nlctrl");
    sock.send().unwrap();
    let mut id = None;
    let end = sock
        .recv_replies::<Error>(seq, |d| {
            let genl = ipvs_netlink::codec::Genl::parse(d)?;
            id = Some(decode_family_id(genl.attr_iter())?);
            Ok(())
        })
        .unwrap();
    assert_eq!(end.errno(), None);
    // GENL_ID_CTRL
    assert_eq!(id, Some(0x10));
}
