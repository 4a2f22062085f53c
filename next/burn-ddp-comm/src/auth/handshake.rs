//! The handshake that opens every connection to the store and between two ranks (see the
//! [module docs](super)): the server's hello, the client's answer under its role's key, the
//! server's proof; every message bounded, every read under one deadline.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::Mac;

use super::{
    JobIdentity, MAC_LEN, MAGIC, MAX_CONTEXT, MAX_MESSAGE, MAX_RUN_ID, NONCE, Role, Service,
    VERSION, mac, random, tag,
};

/// Why a handshake failed, as the side that saw it can tell.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The peer is not a burn-ddp service (what it sent instead, shown).
    NotBurnDdp(String),
    /// The peer belongs to another run.
    OtherRun { theirs: String },
    /// The peer does not hold this job's key (or the role it claims).
    NotAMember(String),
    /// The service is busy (too many connections in their handshake): try again.
    Busy,
    /// The connection failed or a deadline passed.
    Io(io::Error),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NotBurnDdp(what) => write!(f, "not a burn-ddp service ({what})"),
            Refusal::OtherRun { theirs } => write!(f, "it belongs to run {theirs}"),
            Refusal::NotAMember(why) => write!(f, "{why}"),
            Refusal::Busy => write!(f, "busy with other connections"),
            Refusal::Io(e) => write!(f, "{e}"),
        }
    }
}

impl From<io::Error> for Refusal {
    fn from(e: io::Error) -> Self {
        Refusal::Io(e)
    }
}

/// A stream whose every read and write must finish by `deadline`.
struct Timed<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
}

impl Timed<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake did not finish in time",
            ));
        }
        Ok(left)
    }

    /// Reads `buf` whole by the deadline: the time left is set again before every read, so a
    /// peer that sends a byte at a time cannot stretch the handshake past it.
    fn read_exact(&mut self, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let left = self.left()?;
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(buf) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection during the handshake",
                    ));
                }
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes `buf` whole by the deadline (the time left set again before every write).
    fn write_all(&mut self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let left = self.left()?;
            self.stream.set_write_timeout(Some(left))?;
            match self.stream.write(buf) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn byte(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    /// A field of at most `max` bytes behind a one-byte length.
    fn short_field(&mut self, max: usize) -> std::result::Result<Vec<u8>, Refusal> {
        let len = usize::from(self.byte()?);
        if len > max {
            return Err(Refusal::NotBurnDdp(format!("a field of {len} bytes")));
        }
        let mut field = vec![0u8; len];
        self.read_exact(&mut field)?;
        Ok(field)
    }
}

fn put_short(out: &mut Vec<u8>, field: &[u8]) {
    out.push(field.len().min(255) as u8);
    out.extend_from_slice(&field[..field.len().min(255)]);
}

const STATUS_OK: u8 = 0;
const STATUS_OTHER_RUN: u8 = 1;
const STATUS_REFUSED: u8 = 2;

/// The service code of a greeting that says "busy, try again".
const BUSY: u8 = 0;

/// Tells a client the service is busy (it retries), without blocking: at most a few bytes into a
/// fresh connection's send buffer.
pub(crate) fn refuse_busy(stream: &mut TcpStream) {
    let _ = stream.set_nonblocking(true);
    let mut busy = MAGIC.to_vec();
    busy.extend_from_slice(&[VERSION, BUSY]);
    let _ = stream.write_all(&busy);
}

/// What the server side learned of an accepted client.
#[derive(Debug)]
pub(crate) struct Accepted {
    /// The role the client proved.
    pub role: Role,
    /// The client's context (for ranks: rank, world size, round).
    pub context: Vec<u8>,
}

/// The server side of the handshake on `stream` (see the [module docs](self)): challenges the
/// client, checks its answer under the key of the role it claims, and proves the key back.
/// `context` is sent to the client (at most 64 bytes). Everything must finish within `within`.
pub(crate) fn accept(
    stream: &mut TcpStream,
    me: &JobIdentity,
    service: Service,
    context: &[u8],
    within: Duration,
) -> std::result::Result<Accepted, Refusal> {
    let mut io = Timed {
        stream,
        deadline: Instant::now() + within,
    };
    let nonce = random::<NONCE>().map_err(|e| Refusal::Io(io::Error::other(e.to_string())))?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&[VERSION, service.code()]);
    put_short(&mut hello, me.run_id.as_bytes());
    hello.extend_from_slice(&nonce);
    put_short(&mut hello, context);
    io.write_all(&hello)?;

    let mut magic = [0u8; 8];
    io.read_exact(&mut magic)?;
    let (version, kind) = (io.byte()?, io.byte()?);
    if &magic != MAGIC || version != VERSION || kind != service.code() {
        return Err(Refusal::NotBurnDdp(format!(
            "it sent {:?}",
            String::from_utf8_lossy(&magic)
        )));
    }
    let role_code = io.byte()?;
    let run_id = io.short_field(MAX_RUN_ID)?;
    let mut client_nonce = [0u8; NONCE];
    io.read_exact(&mut client_nonce)?;
    let client_context = io.short_field(MAX_CONTEXT)?;
    let mut client_mac = [0u8; MAC_LEN];
    io.read_exact(&mut client_mac)?;

    let refuse = |io: &mut Timed<'_>, status: u8, message: &str| {
        let mut out = vec![status];
        let message = &message.as_bytes()[..message.len().min(MAX_MESSAGE)];
        out.extend_from_slice(&(message.len() as u16).to_le_bytes());
        out.extend_from_slice(message);
        let _ = io.write_all(&out);
    };
    if run_id != me.run_id.as_bytes() {
        let theirs = String::from_utf8_lossy(&run_id).into_owned();
        refuse(&mut io, STATUS_OTHER_RUN, &me.run_id);
        return Err(Refusal::OtherRun { theirs });
    }
    let role = Role::from_code(role_code);
    let key = role.and_then(|role| me.key(role));
    let verified = key.is_some_and(|key| {
        mac(
            key,
            &[
                b"client",
                &[service.code(), role_code],
                &nonce,
                &client_nonce,
                &run_id,
                context,
                &client_context,
            ],
        )
        .verify_slice(&client_mac)
        .is_ok()
    });
    let (Some(role), Some(key), true) = (role, key, verified) else {
        // Nothing about the key or the job's state: a stranger only learns it was refused.
        refuse(&mut io, STATUS_REFUSED, "authentication failed");
        return Err(Refusal::NotAMember(
            "it does not hold this job's key for the role it claims (no or another \
             BURN_DDP_JOB_TOKEN?)"
                .into(),
        ));
    };
    let proof = tag(
        key,
        &[
            b"server",
            &[service.code(), role_code],
            &client_nonce,
            &nonce,
            &run_id,
            &client_context,
            context,
        ],
    );
    let mut answer = vec![STATUS_OK];
    answer.extend_from_slice(&proof);
    io.write_all(&answer)?;
    Ok(Accepted {
        role,
        context: client_context,
    })
}

/// The client side of the handshake on `stream`: checks that the server is a burn-ddp `service`
/// of this run, proves `role`'s key (which `me` must hold), and checks the server's proof.
/// Returns the server's context. Everything must finish within `within`.
pub(crate) fn connect(
    stream: &mut TcpStream,
    me: &JobIdentity,
    service: Service,
    role: Role,
    context: &[u8],
    within: Duration,
) -> std::result::Result<Vec<u8>, Refusal> {
    let key = me.key(role).ok_or_else(|| {
        Refusal::NotAMember("this process does not hold the launchers' key".into())
    })?;
    let mut io = Timed {
        stream,
        deadline: Instant::now() + within,
    };
    let mut magic = [0u8; 8];
    if let Err(e) = io.read_exact(&mut magic) {
        return Err(match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                Refusal::NotBurnDdp("it closed the connection without a greeting".into())
            }
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                Refusal::NotBurnDdp(format!("no greeting within {} s", within.as_secs_f64()))
            }
            _ => Refusal::Io(e),
        });
    }
    let (version, kind) = (io.byte()?, io.byte()?);
    if &magic == MAGIC && kind == BUSY {
        return Err(Refusal::Busy);
    }
    if &magic != MAGIC || kind != service.code() {
        return Err(Refusal::NotBurnDdp(format!(
            "it greeted with {:?}",
            String::from_utf8_lossy(&magic)
        )));
    }
    if version != VERSION {
        return Err(Refusal::NotBurnDdp(format!(
            "it speaks handshake version {version}, this process {VERSION} (different burn-ddp \
             versions?)"
        )));
    }
    let run_id = io.short_field(MAX_RUN_ID)?;
    let mut server_nonce = [0u8; NONCE];
    io.read_exact(&mut server_nonce)?;
    let server_context = io.short_field(MAX_CONTEXT)?;
    if run_id != me.run_id.as_bytes() {
        // Leave without proving anything: it is another job's.
        return Err(Refusal::OtherRun {
            theirs: String::from_utf8_lossy(&run_id).into_owned(),
        });
    }
    let nonce = random::<NONCE>().map_err(|e| Refusal::Io(io::Error::other(e.to_string())))?;
    let proof = tag(
        key,
        &[
            b"client",
            &[service.code(), role.code()],
            &server_nonce,
            &nonce,
            &run_id,
            &server_context,
            context,
        ],
    );
    let mut answer = MAGIC.to_vec();
    answer.extend_from_slice(&[VERSION, service.code(), role.code()]);
    put_short(&mut answer, &run_id);
    answer.extend_from_slice(&nonce);
    put_short(&mut answer, context);
    answer.extend_from_slice(&proof);
    io.write_all(&answer)?;

    let status = io.byte()?;
    if status != STATUS_OK {
        let mut len = [0u8; 2];
        io.read_exact(&mut len)?;
        let len = usize::from(u16::from_le_bytes(len)).min(MAX_MESSAGE);
        let mut message = vec![0u8; len];
        io.read_exact(&mut message)?;
        let message = String::from_utf8_lossy(&message).into_owned();
        return Err(match status {
            STATUS_OTHER_RUN => Refusal::OtherRun { theirs: message },
            _ => Refusal::NotAMember(format!(
                "the {} refused this process: {message} (is BURN_DDP_JOB_TOKEN the same on \
                 every process of the job?)",
                service.name()
            )),
        });
    }
    let mut server_proof = [0u8; MAC_LEN];
    io.read_exact(&mut server_proof)?;
    mac(
        key,
        &[
            b"server",
            &[service.code(), role.code()],
            &nonce,
            &server_nonce,
            &run_id,
            context,
            &server_context,
        ],
    )
    .verify_slice(&server_proof)
    .map_err(|_| {
        Refusal::NotAMember(format!(
            "the {} does not hold this job's key (an impostor, or another BURN_DDP_JOB_TOKEN)",
            service.name()
        ))
    })?;
    Ok(server_context)
}
