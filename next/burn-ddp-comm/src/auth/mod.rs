//! Who belongs to a job: its run id and a secret every process of the job holds, and the
//! challenge-response by which a connection to the rendezvous store or between two ranks proves
//! both before anything else crosses it.
//!
//! **Identity.** A job has a run id (a name, public) and a job token (a secret). The launcher makes
//! both (a random token and run id per job, kept across its restarts) unless `BURN_DDP_JOB_TOKEN`
//! and `BURN_DDP_RUN_ID` are set; under Slurm, `mpirun` over TCP or Kubernetes, set the token by
//! hand (the same value for every process of the job); the run id then comes from the scheduler
//! (Slurm's job and step ids, torchrun's run id, Open MPI's job id, the PMIx namespace). From the
//! token, HMAC-SHA-256 derives two keys bound to the run id: the workers' key and the launchers'
//! key. Launchers hand their workers the workers' key only, so a worker cannot act as a launcher
//! (only launchers may start a restart round). Without any token, the keys derive from the run id
//! alone: two jobs stay apart, but anyone who reaches the port can join (a warning says so).
//!
//! **Handshake** (one per TCP connection, before any request or collective; all messages
//! bounded, every read under a deadline):
//! 1. the server (the store, or the lower rank) sends `magic, version, service, its run id, a
//!    32-byte nonce, its context` (for ranks: rank, world size, restart round);
//! 2. the client checks the magic (else: not a burn-ddp service) and the run id (else: another
//!    job, named), and answers `its role, run id, nonce, context` and the HMAC of all of it under
//!    its role's key;
//! 3. the server checks the run id, the role and the MAC (a stranger is refused and learns
//!    nothing), and proves the key back with an HMAC over the other nonce order.
//!
//! HMAC and SHA-256 come from the `hmac` and `sha2` crates; nonces and tokens from the operating
//! system (`getrandom`). Nothing is encrypted: gradients and values travel in clear, as with Gloo
//! and NCCL.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{CommError, Result};

mod handshake;
pub(crate) use handshake::{Refusal, accept, connect, refuse_busy};

/// The job token (a secret shared by every process of the job; any string).
pub const JOB_TOKEN_VAR: &str = "BURN_DDP_JOB_TOKEN";

/// The run id (a name for the job, public; kept across a launcher's restarts).
pub const RUN_ID_VAR: &str = "BURN_DDP_RUN_ID";

/// The workers' key, hex, which a launcher gives its workers instead of the token.
pub const WORKER_KEY_VAR: &str = "BURN_DDP_WORKER_KEY";

/// Longest run id accepted (bytes).
const MAX_RUN_ID: usize = 128;

/// Longest context a side may send (bytes).
const MAX_CONTEXT: usize = 64;

/// Longest refusal message (bytes).
const MAX_MESSAGE: usize = 512;

const MAGIC: &[u8; 8] = b"BDDPAUTH";
const VERSION: u8 = 1;
const NONCE: usize = 32;
const MAC_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA-256 of `parts` (each length-prefixed, so no two part lists hash alike) under `key`.
fn mac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length: `new_from_slice` cannot fail for it.
    let mut mac = match HmacSha256::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    for part in parts {
        mac.update(&(part.len() as u32).to_le_bytes());
        mac.update(part);
    }
    mac
}

fn tag(key: &[u8], parts: &[&[u8]]) -> [u8; MAC_LEN] {
    mac(key, parts).finalize().into_bytes().into()
}

/// Random bytes from the operating system.
fn random<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| {
        CommError::InvalidConfig(format!("the operating system gave no random bytes: {e}"))
    })?;
    Ok(bytes)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// What a connection proves it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A rank of the job.
    Worker,
    /// A launcher of the job (`burn-ddp run`): may also start restart rounds.
    Launcher,
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Worker => 0,
            Role::Launcher => 1,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Role::Worker),
            1 => Some(Role::Launcher),
            _ => None,
        }
    }
}

/// What a connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Service {
    /// The rendezvous store.
    Store,
    /// A process-group connection between two ranks.
    Group,
}

impl Service {
    fn code(self) -> u8 {
        match self {
            Service::Store => 1,
            Service::Group => 2,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Service::Store => "rendezvous store",
            Service::Group => "rank",
        }
    }
}

/// Where a job's secret comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secret {
    /// The job token (`BURN_DDP_JOB_TOKEN`, or made by the launcher).
    Token,
    /// The workers' key a launcher gave (`BURN_DDP_WORKER_KEY`).
    WorkerKey,
    /// None: the keys derive from the run id alone (jobs stay apart; no authentication).
    None,
}

/// A job's run id and keys (see the [module docs](self)). `Debug` shows no
/// key.
#[derive(Clone)]
pub struct JobIdentity {
    run_id: String,
    worker_key: [u8; 32],
    launcher_key: Option<[u8; 32]>,
    secret: Secret,
    /// The token, for a launcher that hands keys on (never printed).
    token: Option<Vec<u8>>,
}

impl std::fmt::Debug for JobIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobIdentity")
            .field("run_id", &self.run_id)
            .field("secret", &self.secret)
            .finish_non_exhaustive()
    }
}

/// The token every derivation starts from when no job token is given (public: it only keeps
/// runs apart).
const NO_TOKEN: &[u8] = b"burn-ddp: no job token";

impl JobIdentity {
    /// The identity of a job with run id `run_id` and job token `token` (`None`: no secret, the
    /// keys derive from the run id alone).
    ///
    /// # Errors
    /// [`CommError::InvalidConfig`] when `run_id` is empty or longer than 128 bytes, or a given
    /// token is empty.
    pub fn new(run_id: &str, token: Option<&[u8]>) -> Result<Self> {
        check_run_id(run_id)?;
        if token.is_some_and(<[u8]>::is_empty) {
            return Err(CommError::InvalidConfig(format!(
                "{JOB_TOKEN_VAR} is set but empty: give every process of the job the same \
                 non-empty secret"
            )));
        }
        let secret = token.unwrap_or(NO_TOKEN);
        Ok(Self {
            run_id: run_id.to_string(),
            worker_key: tag(secret, &[b"burn-ddp worker key v1", run_id.as_bytes()]),
            launcher_key: Some(tag(
                secret,
                &[b"burn-ddp launcher key v1", run_id.as_bytes()],
            )),
            secret: if token.is_some() {
                Secret::Token
            } else {
                Secret::None
            },
            token: token.map(<[u8]>::to_vec),
        })
    }

    /// A new job's identity for a launcher: `BURN_DDP_JOB_TOKEN` and `BURN_DDP_RUN_ID` when set,
    /// else a random token (made here, when `may_generate`: a single-node job, whose launcher
    /// hands it to every worker) and a random run id, or (several nodes without a token) a run id
    /// from the store's address that every node's launcher computes alike.
    ///
    /// # Errors
    /// As [`new`](Self::new); the operating system's random source failing.
    pub fn for_launcher(may_generate: bool, master: &str) -> Result<Self> {
        let token = token_from_env()?;
        let run_id = match std::env::var(RUN_ID_VAR) {
            Ok(run_id) if !run_id.is_empty() => run_id,
            _ if may_generate => hex(&random::<8>()?),
            _ => format!("launcher-{master}"),
        };
        match token {
            Some(token) => Self::new(&run_id, Some(&token)),
            None if may_generate => Self::new(&run_id, Some(hex(&random::<32>()?).as_bytes())),
            None => Self::new(&run_id, None),
        }
    }

    /// The identity of a process of a job, from the environment: the run id from
    /// `BURN_DDP_RUN_ID`, else the scheduler's (Slurm's job and step, torchrun's run id, Open
    /// MPI's job id, the PMIx namespace), else `fallback`; the secret from the launcher's
    /// `BURN_DDP_WORKER_KEY`, else `BURN_DDP_JOB_TOKEN`, else none.
    ///
    /// # Errors
    /// [`CommError::InvalidConfig`] for a malformed `BURN_DDP_WORKER_KEY` or run id.
    pub fn from_env(fallback: &str) -> Result<Self> {
        let run_id = run_id_from_env().unwrap_or_else(|| fallback.to_string());
        if let Some(key) = std::env::var_os(WORKER_KEY_VAR) {
            let key: [u8; 32] = key
                .to_str()
                .and_then(unhex)
                .and_then(|k| k.try_into().ok())
                .ok_or_else(|| {
                    CommError::InvalidConfig(format!(
                        "{WORKER_KEY_VAR} must be 64 hexadecimal digits (burn-ddp run sets it)"
                    ))
                })?;
            check_run_id(&run_id)?;
            return Ok(Self {
                run_id,
                worker_key: key,
                launcher_key: None,
                secret: Secret::WorkerKey,
                token: None,
            });
        }
        let token = token_from_env()?;
        Self::new(&run_id, token.as_deref())
    }

    /// The run id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Where the secret comes from ([`Secret::None`]: anyone who reaches the port can join).
    pub fn secret(&self) -> Secret {
        self.secret
    }

    /// The variables a launcher gives its workers: the run id and the workers' key (never the
    /// token, so workers cannot act as launchers).
    pub fn worker_env(&self) -> Vec<(String, String)> {
        let mut env = vec![(RUN_ID_VAR.to_string(), self.run_id.clone())];
        if self.secret != Secret::None {
            env.push((WORKER_KEY_VAR.to_string(), hex(&self.worker_key)));
        }
        env
    }

    /// The key of `role`, if this identity holds it.
    fn key(&self, role: Role) -> Option<&[u8; 32]> {
        match role {
            Role::Worker => Some(&self.worker_key),
            Role::Launcher => self.launcher_key.as_ref(),
        }
    }

    /// Whether a token was given by hand or made here (a launcher can hand it to its own workers
    /// only).
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The key that signs this job's checkpoint state files, derived from the workers' key (every
    /// process of the job holds it); `None` without a secret.
    pub fn checkpoint_key(&self) -> Option<CheckpointKey> {
        (self.secret != Secret::None)
            .then(|| CheckpointKey(tag(&self.worker_key, &[b"burn-ddp checkpoint key v1"])))
    }
}

/// The key of a job's checkpoint signatures ([`JobIdentity::checkpoint_key`]). `Debug` shows no
/// key.
#[derive(Clone)]
pub struct CheckpointKey([u8; MAC_LEN]);

impl std::fmt::Debug for CheckpointKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckpointKey(..)")
    }
}

impl CheckpointKey {
    /// The signature of `bytes`, in hexadecimal.
    pub fn sign(&self, bytes: &[u8]) -> String {
        hex(&tag(&self.0, &[b"burn-ddp checkpoint v1", bytes]))
    }

    /// Whether `signature` (hexadecimal) is this key's signature of `bytes`, compared in constant
    /// time.
    pub fn verifies(&self, bytes: &[u8], signature: &str) -> bool {
        unhex(signature).is_some_and(|signature| {
            mac(&self.0, &[b"burn-ddp checkpoint v1", bytes])
                .verify_slice(&signature)
                .is_ok()
        })
    }
}

/// Bytes below which a job token is short: guessable by someone who can try tokens at the port.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The job token of `BURN_DDP_JOB_TOKEN`, as its bytes, whatever they are (a token from
/// `/dev/urandom` is no UTF-8); a warning when it is shorter than [`MIN_TOKEN_BYTES`].
///
/// # Errors
/// [`CommError::InvalidConfig`] naming the variable where the system's strings are not bytes
/// (not on Unix) and it is no Unicode.
fn token_from_env() -> Result<Option<Vec<u8>>> {
    let Some(value) = std::env::var_os(JOB_TOKEN_VAR) else {
        return Ok(None);
    };
    #[cfg(unix)]
    let token = std::os::unix::ffi::OsStringExt::into_vec(value);
    #[cfg(not(unix))]
    let token = value.into_string().map(String::into_bytes).map_err(|_| {
        CommError::InvalidConfig(format!(
            "{JOB_TOKEN_VAR} is not Unicode: give every process the same printable secret, e.g. \
             `openssl rand -hex 32`"
        ))
    })?;
    if !token.is_empty() && token.len() < MIN_TOKEN_BYTES {
        crate::log::warn_console(&format!(
            "{JOB_TOKEN_VAR} has {} bytes: a token of at least {MIN_TOKEN_BYTES} random bytes \
             cannot be guessed at the job's ports; make one with \
             `export {JOB_TOKEN_VAR}=$(openssl rand -hex 32)`",
            token.len()
        ));
    }
    Ok(Some(token))
}

/// The identity the unit tests' jobs share.
#[cfg(any(test, feature = "test-support"))]
pub(crate) fn test_job() -> JobIdentity {
    JobIdentity::new("unit-tests", Some(b"unit-test token"))
        .unwrap_or_else(|e| unreachable!("a valid test identity: {e}"))
}

fn check_run_id(run_id: &str) -> Result<()> {
    if run_id.is_empty() || run_id.len() > MAX_RUN_ID {
        return Err(CommError::InvalidConfig(format!(
            "a run id must have 1 to {MAX_RUN_ID} bytes, got {} ({RUN_ID_VAR})",
            run_id.len()
        )));
    }
    Ok(())
}

/// A new run id for a process the environment names no run for: `local-` and 8 random bytes
/// (the process id when the operating system gives no random bytes).
pub fn local_run_id() -> String {
    match random::<8>() {
        Ok(bytes) => format!("local-{}", hex(&bytes)),
        Err(_) => format!("local-{}", std::process::id()),
    }
}

/// The run id the environment gives, if any: `BURN_DDP_RUN_ID`, else the scheduler's.
pub fn run_id_from_env() -> Option<String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let Some(run_id) = var(RUN_ID_VAR) {
        return Some(run_id);
    }
    if let Some(job) = var("SLURM_JOB_ID") {
        return Some(match var("SLURM_STEP_ID") {
            Some(step) => format!("slurm-{job}.{step}"),
            None => format!("slurm-{job}"),
        });
    }
    if let Some(run) = var("TORCHELASTIC_RUN_ID") {
        return Some(format!("torchelastic-{run}"));
    }
    if let Some(job) = var("OMPI_MCA_ess_base_jobid") {
        return Some(format!("ompi-{job}"));
    }
    var("PMIX_NAMESPACE").map(|ns| format!("pmix-{ns}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    /// Runs `server` and `client` on the two ends of a loopback connection.
    fn pair<S: Send, C>(
        server: impl FnOnce(&mut TcpStream) -> S + Send,
        client: impl FnOnce(&mut TcpStream) -> C,
    ) -> (S, C) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::scope(|s| {
            let accepted = s.spawn(move || {
                let (mut stream, _) = listener.accept().unwrap();
                server(&mut stream)
            });
            let mut stream = TcpStream::connect(addr).unwrap();
            let c = client(&mut stream);
            (accepted.join().unwrap(), c)
        })
    }

    const WITHIN: Duration = Duration::from_secs(5);

    #[test]
    fn members_are_accepted_and_strangers_and_other_runs_are_refused() {
        let job = JobIdentity::new("run-a", Some(b"secret")).unwrap();
        let (server, client) = pair(
            |s| accept(s, &job, Service::Store, b"srv", WITHIN),
            |s| connect(s, &job, Service::Store, Role::Worker, b"cli", WITHIN),
        );
        let accepted = server.unwrap();
        assert_eq!(
            (accepted.role, accepted.context),
            (Role::Worker, b"cli".to_vec())
        );
        assert_eq!(client.unwrap(), b"srv".to_vec());

        // Another token: refused on both sides, nothing learnt.
        let stranger = JobIdentity::new("run-a", Some(b"guess")).unwrap();
        let (server, client) = pair(
            |s| accept(s, &job, Service::Store, b"", WITHIN),
            |s| connect(s, &stranger, Service::Store, Role::Worker, b"", WITHIN),
        );
        assert!(matches!(server, Err(Refusal::NotAMember(_))), "{server:?}");
        let client = client.unwrap_err().to_string();
        assert!(client.contains("authentication failed"), "{client}");

        // Another run: the client leaves without proving anything.
        let other = JobIdentity::new("run-b", Some(b"secret")).unwrap();
        let (server, client) = pair(
            |s| accept(s, &job, Service::Store, b"", WITHIN),
            |s| connect(s, &other, Service::Store, Role::Worker, b"", WITHIN),
        );
        assert!(server.is_err());
        match client {
            Err(Refusal::OtherRun { theirs }) => assert_eq!(theirs, "run-a"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn workers_cannot_act_as_launchers_and_an_impostor_server_is_found() {
        let launcher = JobIdentity::new("run-a", Some(b"secret")).unwrap();
        let env: std::collections::HashMap<String, String> =
            launcher.worker_env().into_iter().collect();
        let worker = JobIdentity {
            run_id: "run-a".into(),
            worker_key: unhex(&env[WORKER_KEY_VAR]).unwrap().try_into().unwrap(),
            launcher_key: None,
            secret: Secret::WorkerKey,
            token: None,
        };
        // The worker key works as a worker, and the worker has no launcher key to claim.
        let (server, client) = pair(
            |s| accept(s, &launcher, Service::Store, b"", WITHIN),
            |s| connect(s, &worker, Service::Store, Role::Worker, b"", WITHIN),
        );
        assert!(server.is_ok() && client.is_ok());
        let (_, client) = pair(
            |s| {
                let _ = accept(s, &launcher, Service::Store, b"", WITHIN);
            },
            |s| connect(s, &worker, Service::Store, Role::Launcher, b"", WITHIN),
        );
        assert!(matches!(client, Err(Refusal::NotAMember(_))));
        // A server that does not hold the key cannot pass its proof.
        let impostor = JobIdentity::new("run-a", Some(b"other")).unwrap();
        let (_, client) = pair(
            |s| accept(s, &impostor, Service::Store, b"", WITHIN),
            |s| connect(s, &launcher, Service::Store, Role::Worker, b"", WITHIN),
        );
        assert!(client.is_err());
    }

    #[test]
    fn a_client_that_trickles_its_handshake_is_dropped_at_the_deadline() {
        // A stranger sends a valid greeting, then a run id of 128 bytes one byte at a time, each
        // well within the deadline: the deadline is for the whole handshake, not per read.
        let job = JobIdentity::new("run-a", Some(b"secret")).unwrap();
        let within = Duration::from_millis(600);
        let (server, ()) = pair(
            |s| {
                let started = Instant::now();
                let accepted = accept(s, &job, Service::Store, b"", within);
                (accepted.is_err(), started.elapsed())
            },
            |s| {
                let mut greeting = MAGIC.to_vec();
                greeting.extend_from_slice(&[VERSION, Service::Store.code(), 0, 128]);
                if s.write_all(&greeting).is_err() {
                    return;
                }
                for _ in 0..8 {
                    std::thread::sleep(Duration::from_millis(250));
                    if s.write_all(b"x").is_err() {
                        return;
                    }
                }
            },
        );
        let (refused, took) = server;
        assert!(refused);
        assert!(
            took < Duration::from_millis(1500),
            "the server held the trickling client for {took:?} (deadline {within:?})"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("BURN_DDP_FUZZ_CASES")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(12),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Past the magic: a valid greeting's start, then a service, a role and a run id
        /// length that may be wrong (0, the limit, one past it, anything), a field cut short,
        /// a nonce, context and MAC cut anywhere, sent whole or a byte at a time. The server
        /// refuses within its deadline, never panics, and a member still gets in.
        #[test]
        fn mutated_handshakes_past_the_magic_are_refused_within_the_deadline(
            service in proptest::prelude::prop_oneof![
                proptest::prelude::Just(1u8),
                proptest::prelude::any::<u8>()
            ],
            role in proptest::prelude::any::<u8>(),
            length in proptest::prelude::prop_oneof![
                proptest::prelude::Just(0u8),
                proptest::prelude::Just(MAX_RUN_ID as u8),
                proptest::prelude::Just(MAX_RUN_ID as u8 + 1),
                proptest::prelude::any::<u8>()
            ],
            rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..160),
            trickle in proptest::prelude::any::<bool>(),
        ) {
            let job = JobIdentity::new("run-a", Some(b"secret")).unwrap();
            let within = Duration::from_millis(400);
            let (server, ()) = pair(
                |s| {
                    let started = Instant::now();
                    (accept(s, &job, Service::Store, b"", within).is_err(), started.elapsed())
                },
                |s| {
                    let mut message = MAGIC.to_vec();
                    message.extend_from_slice(&[VERSION, service, role, length]);
                    message.extend_from_slice(&rest);
                    if trickle {
                        for byte in message.chunks(1).take(12) {
                            std::thread::sleep(Duration::from_millis(40));
                            if s.write_all(byte).is_err() {
                                return;
                            }
                        }
                    } else {
                        let _ = s.write_all(&message);
                    }
                },
            );
            let (refused, took) = server;
            proptest::prop_assert!(refused);
            proptest::prop_assert!(took < Duration::from_millis(1200), "{:?}", took);
            // The job goes on: a member is accepted.
            let (server, client) = pair(
                |s| accept(s, &job, Service::Store, b"", WITHIN),
                |s| connect(s, &job, Service::Store, Role::Worker, b"", WITHIN),
            );
            proptest::prop_assert!(server.is_ok() && client.is_ok());
        }
    }

    #[test]
    fn a_silent_or_foreign_service_is_named_within_the_deadline() {
        let job = JobIdentity::new("run-a", None).unwrap();
        let started = Instant::now();
        let (_, client) = pair(
            |s| {
                std::thread::sleep(Duration::from_millis(600));
                let _ = s;
            },
            |s| {
                connect(
                    s,
                    &job,
                    Service::Store,
                    Role::Worker,
                    b"",
                    Duration::from_millis(300),
                )
            },
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(client.unwrap_err().to_string().contains("no greeting"));
        let (_, client) = pair(
            |s| s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap(),
            |s| connect(s, &job, Service::Store, Role::Worker, b"", WITHIN),
        );
        let message = client.unwrap_err().to_string();
        assert!(message.contains("not a burn-ddp service"), "{message}");
    }
}
