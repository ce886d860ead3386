//! Client-side rate limit of Kubernetes API requests: `clientConnection.qps` / `burst`.
//!
//! Like client-go's default (`flowcontrol.NewTokenBucketRateLimiter(qps, burst)`, used by
//! upstream kube-proxy through `rest.Config.QPS/Burst`): a token bucket that holds up to
//! `burst` tokens, refills at `qps` per second and starts full; every request takes one token
//! and waits until it is available. A watch is one request (its long-lived response body is
//! not metered), and so is a paginated list: its continuation pages (requests with a
//! `continue=` token) give their token back. Upstream's informers list in one request
//! (client-go's reflector lists at resourceVersion "0", served from the API server's watch
//! cache, `relistResourceVersion` in `tools/cache/reflector.go`); this source pages its lists
//! (500 objects a page, to bound memory), and the same QPS budget would otherwise hold a
//! 10,000-Service list back for seconds (20 pages per kind at 5 per second after the burst).
//! `qps <= 0` disables the limit (as in client-go, where no rate limiter is installed then); a
//! burst of 0 is treated as 1.
//!
//! [`QpsLayer`] is a tower layer added to kube's client stack (`ClientBuilder::with_layer`).
//! kube wraps the stack in a `Buffer`, so all requests of one client share one bucket and
//! wait in order. A wait over one second is logged, like client-go's "Waited for … due to
//! client-side throttling".

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A token bucket with time passed in (pure; tests inject it).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens refilling at `qps` per second.
    pub fn new(qps: f64, burst: u32, now: Instant) -> TokenBucket {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            qps,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes one token at `now` and returns how long the caller must wait before using it
    /// (zero when one was available). Tokens are reserved in order: callers that wait are
    /// spaced `1/qps` apart.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        if now > self.last {
            self.last = now;
        }
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }

    /// Gives one token back (a request that does not count: a list's continuation page), up to
    /// the burst.
    pub fn refund(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.burst);
    }
}

/// Whether `uri` asks for a continuation page of a list (a non-empty `continue` parameter).
pub fn is_continuation(uri: &hyper::Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|kv| kv.strip_prefix("continue=").is_some_and(|v| !v.is_empty()))
    })
}

/// The tower layer: every request through it takes a token first.
#[derive(Debug, Clone)]
pub struct QpsLayer {
    bucket: Option<Arc<Mutex<TokenBucket>>>,
}

impl QpsLayer {
    /// `qps` requests per second with bursts of `burst`; `qps <= 0` (or not finite): no limit.
    pub fn new(qps: f64, burst: u32) -> QpsLayer {
        let bucket = (qps > 0.0 && qps.is_finite())
            .then(|| Arc::new(Mutex::new(TokenBucket::new(qps, burst, Instant::now()))));
        QpsLayer { bucket }
    }
}

impl<S> tower::Layer<S> for QpsLayer {
    type Service = QpsService<S>;
    fn layer(&self, inner: S) -> QpsService<S> {
        QpsService {
            inner,
            bucket: self.bucket.clone(),
            wait: None,
            granted: false,
        }
    }
}

/// The service [`QpsLayer`] wraps around kube's stack.
pub struct QpsService<S> {
    inner: S,
    bucket: Option<Arc<Mutex<TokenBucket>>>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    granted: bool,
}

impl<S> std::fmt::Debug for QpsService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpsService")
            .field("limited", &self.bucket.is_some())
            .field("granted", &self.granted)
            .finish_non_exhaustive()
    }
}

impl<S, B> tower::Service<hyper::Request<B>> for QpsService<S>
where
    S: tower::Service<hyper::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let (Some(bucket), false) = (&self.bucket, self.granted) {
            if self.wait.is_none() {
                let wait = {
                    let mut b = match bucket.lock() {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                    b.reserve(Instant::now())
                };
                if wait.is_zero() {
                    self.granted = true;
                } else {
                    if wait > Duration::from_secs(1) {
                        tracing::info!(
                            wait_seconds = wait.as_secs_f64(),
                            "waiting due to client-side throttling (clientConnection.qps/burst)"
                        );
                    }
                    self.wait = Some(Box::pin(tokio::time::sleep(wait)));
                }
            }
            if let Some(w) = &mut self.wait {
                if w.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.wait = None;
                self.granted = true;
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: hyper::Request<B>) -> S::Future {
        self.granted = false;
        if let Some(bucket) = &self.bucket {
            if is_continuation(req.uri()) {
                bucket.lock().unwrap_or_else(|p| p.into_inner()).refund();
            }
        }
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use tower::{Layer, Service};

    #[test]
    fn bucket_starts_full_then_spaces_requests_at_qps() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(5.0, 10, t0);
        // The burst passes at once.
        for _ in 0..10 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        // Then each request waits one more 1/qps (reservations queue up).
        for i in 1..=5u32 {
            let w = b.reserve(t0).as_secs_f64();
            assert!((w - f64::from(i) * 0.2).abs() < 1e-9, "{i}: {w}");
        }
        // After the queued ones are due, the bucket refills at qps up to the burst only.
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..10 {
            assert_eq!(b.reserve(later), Duration::ZERO);
        }
        assert!(b.reserve(later) > Duration::ZERO, "burst is the cap");
        // Half a second of refill at 5 qps: 2.5 tokens.
        let mut b = TokenBucket::new(5.0, 1, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        let w = b.reserve(t0 + Duration::from_millis(100)).as_secs_f64();
        assert!((w - 0.1).abs() < 1e-9, "{w}");
        // Burst 0 is 1.
        let mut b = TokenBucket::new(1.0, 0, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert!(b.reserve(t0) > Duration::ZERO);
    }

    #[test]
    fn time_going_backwards_never_adds_tokens() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let mut b = TokenBucket::new(1.0, 1, t0);
        assert_eq!(b.reserve(t0), Duration::ZERO);
        assert!(b.reserve(t0 - Duration::from_secs(5)) > Duration::ZERO);
    }

    /// A service that counts calls and is always ready.
    struct Count(usize);
    impl Service<hyper::Request<()>> for Count {
        type Response = ();
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<(), Self::Error>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: hyper::Request<()>) -> Self::Future {
            self.0 += 1;
            std::future::ready(Ok(()))
        }
    }

    fn get(uri: &str) -> hyper::Request<()> {
        hyper::Request::get(uri).body(()).unwrap()
    }

    #[test]
    fn only_a_non_empty_continue_token_is_a_continuation() {
        let yes = "/api/v1/services?limit=500&continue=abc";
        assert!(is_continuation(&yes.parse().unwrap()));
        assert!(is_continuation(
            &"/x?continue=a%3D&limit=5".parse().unwrap()
        ));
        for no in [
            "/api/v1/services?limit=500",
            "/api/v1/services?limit=500&continue=",
            "/api/v1/services",
            "/x?notcontinue=abc",
        ] {
            assert!(!is_continuation(&no.parse().unwrap()), "{no}");
        }
    }

    #[tokio::test]
    async fn a_paginated_list_takes_one_token() {
        let mut svc = QpsLayer::new(0.001, 2).layer(Count(0));
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // The first page takes a token; its 50 continuation pages give theirs back.
        assert!(svc.poll_ready(&mut cx).is_ready());
        svc.call(get("/api/v1/services?limit=500")).await.unwrap();
        for i in 0..50 {
            assert!(svc.poll_ready(&mut cx).is_ready(), "page {i}");
            svc.call(get(&format!("/api/v1/services?limit=500&continue=t{i}")))
                .await
                .unwrap();
        }
        // One token of the burst of 2 is left: one more request passes, the next waits.
        assert!(svc.poll_ready(&mut cx).is_ready());
        svc.call(get("/apis/discovery.k8s.io/v1/endpointslices?limit=500"))
            .await
            .unwrap();
        assert!(svc.poll_ready(&mut cx).is_pending());
        assert_eq!(svc.inner.0, 52);
    }

    #[tokio::test]
    async fn layer_admits_the_burst_then_holds_requests_back() {
        let mut svc = QpsLayer::new(0.001, 3).layer(Count(0));
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..3 {
            assert!(svc.poll_ready(&mut cx).is_ready());
            svc.call(get("/api/v1/nodes")).await.unwrap();
        }
        // The fourth waits (1,000 s at 0.001 qps): not ready, and polling again does not take
        // another token.
        assert!(svc.poll_ready(&mut cx).is_pending());
        assert!(svc.poll_ready(&mut cx).is_pending());
        assert_eq!(svc.inner.0, 3);
        // Without a limit, always ready.
        let mut free = QpsLayer::new(0.0, 0).layer(Count(0));
        for _ in 0..1000 {
            assert!(free.poll_ready(&mut cx).is_ready());
            free.call(get("/api/v1/nodes")).await.unwrap();
        }
        assert_eq!(free.inner.0, 1000);
    }
}
