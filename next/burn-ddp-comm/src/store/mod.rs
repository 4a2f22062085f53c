//! The rendezvous store: a small TCP key-value server, the counterpart of PyTorch's `TCPStore`.
//!
//! Rank 0 (or the launcher) serves it at `MASTER_ADDR:MASTER_PORT`, bound to that address only
//! (`BURN_DDP_STORE_BIND` overrides it); every process connects as a client. Keys are strings,
//! values bytes. Operations, each with a timeout:
//! - [`set`](StoreClient::set) a value;
//! - [`get`](StoreClient::get) a value, waiting until some process has set it;
//! - [`add`](StoreClient::add) to a counter (stored as decimal text) and read the new value;
//! - [`check`](StoreClient::check) which of some keys exist, without waiting;
//! - [`wait`](StoreClient::wait) until all of some keys exist.
//!
//! **Only the job's processes.** Every connection starts with the job's challenge-response
//! ([`auth`]): a process of another run is refused naming both run ids, a
//! stranger is refused and learns nothing. Keys under `burn-ddp/launcher/` (the restart round)
//! are written by launchers only. **Bounded.** At most 64 connections may be in their handshake
//! (5 s each, off the accept loop) and 4096 served; a request must arrive whole within 10 s once
//! begun; keys are at most 1 KiB, values 1 MiB, the table 64 MiB, a request 65,536 keys.
//!
//! Wire format after the handshake (all integers little-endian): a request is an operation byte
//! followed by its fields, a string or byte field being a `u32` length then the bytes; a reply is
//! a status byte (0 ok, 1 timeout, 2 refused followed by why) followed by the result.//!
//! One job per file: the server in `server.rs` ([`StoreServer`], its limits, its sessions), the
//! client in `client.rs` ([`StoreClient`]); here the wire format both speak and the limits both
//! check.

mod client;
mod server;

pub use client::StoreClient;
pub use server::{StoreServer, bind_address, host_port};

use std::io::{self, Read};
use std::time::Duration;

use crate::auth::{self, JobIdentity};
use crate::error::CommError;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_WAIT: u8 = 5;

const STATUS_OK: u8 = 0;
const STATUS_TIMEOUT: u8 = 1;
const STATUS_REFUSED: u8 = 2;

/// Largest key accepted (1 KiB).
const MAX_KEY: usize = 1 << 10;
/// Largest value accepted (1 MiB: the largest burn-ddp stores is an address or NCCL's 128-byte
/// id).
const MAX_VALUE: usize = 1 << 20;
/// Largest table (keys, values and each entry's bookkeeping together: 64 MiB).
const MAX_TABLE: usize = 64 << 20;
/// What an entry costs beyond its key's and value's bytes (the map's slot, two allocations), so
/// that a table of tiny entries is bounded by the memory it takes.
const ENTRY_OVERHEAD: usize = 96;
/// Most keys the table holds (a job of the most ranks, 65,536, needs a few per rank and round;
/// with their overhead they stay below `MAX_TABLE`).
const MAX_ENTRIES: usize = 1 << 19;
/// Most bytes of keys in one request.
const MAX_REQUEST_KEY_BYTES: usize = 4 << 20;
/// The longest a GET or WAIT parks a session: a client that waits longer asks again (and a
/// client that left is noticed every [`ALIVE_EVERY`]).
const MAX_WAIT: Duration = Duration::from_secs(600);
/// How often a parked session looks whether its client is still there.
const ALIVE_EVERY: Duration = Duration::from_secs(1);
/// Most keys in one request.
pub(crate) const MAX_KEYS: usize = 1 << 16;
/// Connections at most in their handshake at once (more are closed at once).
const MAX_HANDSHAKES: usize = 64;
/// Connections in their handshake at once from one address (the job's ranks on one node share
/// theirs; a client told "busy" tries again).
const MAX_HANDSHAKES_PER_SOURCE: usize = 16;
/// At most one line of a kind of refusal in this long (with the count of those left out).
const LOG_EVERY: Duration = Duration::from_secs(10);
/// Connections served at most at once.
const MAX_SESSIONS: usize = 4096;
/// How long a connection has for its handshake.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// How long the rest of a request may take to arrive once its first byte came.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// Keys only launchers may write (the restart round).
pub(crate) const LAUNCHER_PREFIX: &str = "burn-ddp/launcher/";

/// The variable that overrides the address the store binds (default: the address it is reached
/// at, `MASTER_ADDR`).
pub const STORE_BIND_VAR: &str = "BURN_DDP_STORE_BIND";

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A length-prefixed field of at most `max` bytes (checked before anything is allocated).
fn read_bytes(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a field of {len} bytes, more than {max}"),
        ));
    }
    let mut value = vec![0u8; len];
    r.read_exact(&mut value)?;
    Ok(value)
}

fn read_string(r: &mut impl Read, max: usize) -> io::Result<String> {
    String::from_utf8(read_bytes(r, max)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
}

fn read_keys(r: &mut impl Read) -> io::Result<Vec<String>> {
    let mut count = [0u8; 4];
    r.read_exact(&mut count)?;
    let count = u32::from_le_bytes(count) as usize;
    if count > MAX_KEYS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{count} keys in one request, more than {MAX_KEYS}"),
        ));
    }
    let mut total = 0;
    (0..count)
        .map(|_| {
            let key = read_string(r, MAX_KEY)?;
            total += key.len();
            if total > MAX_REQUEST_KEY_BYTES {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("more than {MAX_REQUEST_KEY_BYTES} bytes of keys in one request"),
                ));
            }
            Ok(key)
        })
        .collect()
}

/// Appends a length-prefixed field. Callers keep fields under [`MAX_VALUE`] (checked in
/// [`StoreClient::set`]), so the length fits in a `u32`.
fn put_bytes(out: &mut Vec<u8>, value: &[u8]) {
    out.extend_from_slice(&(value.len().min(u32::MAX as usize) as u32).to_le_bytes());
    out.extend_from_slice(value);
}

fn put_keys(out: &mut Vec<u8>, keys: &[&str]) {
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for key in keys {
        put_bytes(out, key.as_bytes());
    }
}

/// What a failed handshake with the store at `addr` means, for a process of `job`.
fn refusal(why: &auth::Refusal, job: &JobIdentity) -> String {
    match why {
        auth::Refusal::OtherRun { theirs } => format!(
            "the store there belongs to run {theirs}, this process to run {}: two jobs share \
             MASTER_ADDR:MASTER_PORT (give each job its own MASTER_PORT), or the processes of one \
             job were given different BURN_DDP_RUN_ID values",
            job.run_id()
        ),
        auth::Refusal::NotBurnDdp(what) => format!(
            "the service at this address is not a burn-ddp rendezvous store ({what}): is \
             MASTER_PORT the port of another service?"
        ),
        other => other.to_string(),
    }
}

fn store_error(addr: &str, op: &str, detail: String) -> CommError {
    CommError::Store {
        addr: addr.to_string(),
        op: op.to_string(),
        detail,
    }
}

fn millis(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::thread;
    use std::time::Instant;

    use super::server::Entries;
    use crate::auth::{Role, Service};
    use crate::error::Result;

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), &crate::auth::test_job()).unwrap()
    }

    fn client(server: &StoreServer) -> StoreClient {
        StoreClient::connect(
            &server.local_addr().to_string(),
            Duration::from_secs(5),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .unwrap()
    }

    #[test]
    fn the_store_binds_the_address_it_is_reached_at_unless_that_cannot_serve_the_job() {
        let bind = |host: &str, several_nodes| {
            bind_address(host, 29_500, several_nodes)
                .unwrap()
                .to_string()
        };
        // One node: loopback stays loopback (no other host can reach the store).
        assert_eq!(bind("127.0.0.1", false), "127.0.0.1:29500");
        assert_eq!(bind("[::1]", false), "[::1]:29500");
        // Several nodes reach a store whose own host name resolves to loopback by another name.
        assert_eq!(bind("127.0.0.1", true), "0.0.0.0:29500");
        assert_eq!(bind("::1", true), "[::]:29500");
        // An address of another host (TEST-NET-1): it cannot be bound here.
        assert_eq!(bind("192.0.2.1", false), "0.0.0.0:29500");
        assert!(bind_address("no-such-host.invalid", 29_500, false).is_err());
    }

    #[test]
    fn set_get_add_check_and_wait() {
        let server = server();
        let a = client(&server);
        let b = client(&server);
        a.set("x", b"hello").unwrap();
        assert_eq!(b.get("x", Duration::from_secs(1)).unwrap(), b"hello");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 3).unwrap(), 5);
        assert_eq!(b.get("n", Duration::from_secs(1)).unwrap(), b"5");
        assert_eq!(a.check(&["x", "y", "n"]).unwrap(), vec![true, false, true]);
        a.wait(&["x", "n"], Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn get_waits_for_a_later_set() {
        let server = server();
        let addr = server.local_addr().to_string();
        let setter = thread::spawn(move || {
            let c = StoreClient::connect(
                &addr,
                Duration::from_secs(5),
                &crate::auth::test_job(),
                crate::auth::Role::Worker,
            )
            .unwrap();
            thread::sleep(Duration::from_millis(200));
            c.set("late", b"v").unwrap();
        });
        let value = client(&server)
            .get("late", Duration::from_secs(10))
            .unwrap();
        assert_eq!(value, b"v");
        setter.join().unwrap();
    }

    #[test]
    fn timeouts_name_the_key() {
        let server = server();
        let c = client(&server);
        let started = Instant::now();
        let err = c
            .get("never", Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("get `never`") && err.contains("not set within 0.3 s"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        let err = c
            .wait(&["a", "b"], Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(err.contains("a, b"), "{err}");
    }

    #[test]
    fn a_port_in_use_is_named() {
        let server = server();
        let err = StoreServer::bind(server.local_addr(), &crate::auth::test_job())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("already in use"), "{err}");
        assert!(
            err.contains(&server.local_addr().port().to_string()),
            "{err}"
        );
    }

    #[test]
    fn connecting_to_nothing_fails_within_the_timeout() {
        // Bind then drop to get a port nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let started = Instant::now();
        let err = StoreClient::connect(
            &format!("127.0.0.1:{port}"),
            Duration::from_millis(500),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("no store answered within 0.5 s"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    fn connect_as(server: &StoreServer, job: &JobIdentity, role: Role) -> Result<StoreClient> {
        StoreClient::connect(
            &server.local_addr().to_string(),
            Duration::from_secs(2),
            job,
            role,
        )
    }

    #[test]
    fn strangers_and_other_runs_are_refused_and_the_job_goes_on() {
        let server = server();
        let member = client(&server);
        member.set("secret", b"value").unwrap();
        // Another token: refused, learns nothing.
        let stranger = JobIdentity::new("unit-tests", Some(b"guess")).unwrap();
        let err = connect_as(&server, &stranger, Role::Worker)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("authentication failed"), "{err}");
        // Another run: named, with both ids.
        let other = JobIdentity::new("job-b", Some(b"unit-test token")).unwrap();
        let err = connect_as(&server, &other, Role::Worker)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("belongs to run unit-tests") && err.contains("this process to run job-b"),
            "{err}"
        );
        // Raw bytes without the handshake: the server closes the connection, keeps serving.
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        let _ = raw.write_all(&[OP_GET, 6, 0, 0, 0]);
        let _ = raw.write_all(b"secret");
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut seen = Vec::new();
        let _ = raw.read_to_end(&mut seen);
        assert!(!seen.windows(5).any(|w| w == b"value"), "the value leaked");
        assert_eq!(
            member.get("secret", Duration::from_secs(1)).unwrap(),
            b"value"
        );
    }

    #[test]
    fn only_launchers_write_the_launcher_keys() {
        let server = server();
        let worker = client(&server);
        let launcher = connect_as(&server, &crate::auth::test_job(), Role::Launcher).unwrap();
        let round = format!("{LAUNCHER_PREFIX}round");
        let err = worker.add(&round, 1).unwrap_err().to_string();
        assert!(err.contains("written by launchers only"), "{err}");
        assert!(worker.set(&round, b"7").is_err());
        assert_eq!(launcher.add(&round, 1).unwrap(), 1);
        // Workers read it, and members write the abort keys.
        assert_eq!(worker.add(&round, 0).unwrap(), 1);
        worker.set("burn-ddp/round-0/abort", b"why").unwrap();
    }

    #[test]
    fn sizes_are_bounded_and_a_non_store_service_is_named() {
        let server = server();
        let c = client(&server);
        let err = c
            .set("big", &vec![0u8; MAX_VALUE + 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("limited to"), "{err}");
        // A service that is not a store answers something else: named at once.
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = other.local_addr().unwrap();
        let serving = thread::spawn(move || {
            if let Ok((mut stream, _)) = other.accept() {
                let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            }
        });
        let started = Instant::now();
        let err = StoreClient::connect(
            &addr.to_string(),
            Duration::from_secs(30),
            &crate::auth::test_job(),
            Role::Worker,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("not a burn-ddp rendezvous store"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
        serving.join().unwrap();
    }

    #[test]
    fn counters_count_against_the_table_and_the_table_bounds_its_keys() {
        let full = server();
        let c = client(&full);
        // Fill the table with values of halving size until not even one byte more fits.
        let mut size = MAX_VALUE;
        let mut n = 0;
        while size > 0 {
            if c.set(&format!("fill-{n}"), &vec![0u8; size]).is_err() {
                size /= 2;
            }
            n += 1;
        }
        // A new counter takes room too: refused, not added past the bound.
        let err = c.add("counter", 1).unwrap_err().to_string();
        assert!(err.contains("at most"), "{err}");
        // A table of tiny entries is bounded by its count of keys, and counts what each entry
        // costs beyond its bytes.
        let mut entries = Entries::default();
        for i in 0..MAX_ENTRIES {
            let key = i.to_string();
            entries.charge(&key, 1).unwrap();
            entries.map.insert(key, vec![1]);
        }
        let err = entries.charge("one more", 1).unwrap_err();
        assert!(err.contains("at most"), "{err}");
        assert!(entries.bytes >= MAX_ENTRIES * ENTRY_OVERHEAD);
        // Replacing a key's value costs no new key.
        entries.charge("0", 2).unwrap();
    }

    #[test]
    fn a_wait_without_end_from_a_client_that_left_frees_its_session() {
        let server = server();
        let c = client(&server);
        {
            // A member asks for a key nobody sets, with no end to the wait, and leaves.
            let mut request = vec![OP_GET];
            put_bytes(&mut request, b"never-set");
            request.extend_from_slice(&u64::MAX.to_le_bytes());
            let mut stream = c
                .stream
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            stream.write_all(&request).unwrap();
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        drop(c);
        let started = Instant::now();
        while server.sessions() > 0 && started.elapsed() < Duration::from_secs(10) {
            thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(server.sessions(), 0, "the parked session was not freed");
    }

    #[test]
    fn idle_connections_do_not_keep_the_job_out() {
        let server = server();
        // More idle connections than may be in their handshake at once.
        let idle: Vec<TcpStream> = (0..MAX_HANDSHAKES + 16)
            .filter_map(|_| TcpStream::connect(server.local_addr()).ok())
            .collect();
        let started = Instant::now();
        // Within the handshake deadline the slots free up and the job's process gets in.
        let c = StoreClient::connect(
            &server.local_addr().to_string(),
            Duration::from_secs(20),
            &crate::auth::test_job(),
            Role::Worker,
        );
        assert!(c.is_ok(), "{:?}", c.err());
        assert!(
            started.elapsed() < HANDSHAKE_DEADLINE * 3,
            "{:?}",
            started.elapsed()
        );
        drop(idle);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("BURN_DDP_FUZZ_CASES")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(24),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Random and truncated frames, before and after the handshake: the server neither
        /// panics nor allocates beyond its bounds, and keeps serving the job.
        #[test]
        fn random_frames_never_stop_the_store(
            before in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            after in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            op in 0u8..8,
            claimed_len in proptest::prelude::any::<u32>(),
        ) {
            let server = server();
            let member = client(&server);
            member.set("k", b"v").unwrap();
            // Garbage instead of a handshake.
            if let Ok(mut raw) = TcpStream::connect(server.local_addr()) {
                let _ = raw.write_all(&before);
            }
            // A member's session, then a frame with a random operation and claimed length.
            if let Ok(mut raw) = TcpStream::connect(server.local_addr()) {
                let job = crate::auth::test_job();
                if auth::connect(&mut raw, &job, Service::Store, Role::Worker, b"", HANDSHAKE_DEADLINE).is_ok() {
                    let mut frame = vec![op];
                    frame.extend_from_slice(&claimed_len.to_le_bytes());
                    frame.extend_from_slice(&after);
                    let _ = raw.write_all(&frame);
                }
            }
            proptest::prop_assert_eq!(member.get("k", Duration::from_secs(2)).unwrap(), b"v".to_vec());
            proptest::prop_assert!(client(&server).check(&["k"]).unwrap()[0]);
        }
    }
}
