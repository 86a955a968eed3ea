"""Write router/gateway/envoy_api/**.proto: the part of Envoy's API (v3) that the ext_proc service reaches,
as .proto text, from the descriptors of the `xds-protos` package (Envoy's API with generated stubs).

Run it in a scratch virtualenv, never the project's: xds-protos also installs an old copy of OpenTelemetry's
protos over opentelemetry-proto's, which breaks the OTLP exporter (grpc/grpc#42926); that is why fleetroute
carries this subset instead of depending on xds-protos.

    python -m venv /tmp/xds && /tmp/xds/bin/pip install xds-protos==1.85.0
    /tmp/xds/bin/python scripts/envoy-ext-proc-protos.py router/gateway/envoy_api .

Then regenerate the stubs as router/gateway/envoy_api/__init__.py says. Every message type the service's
request and response reach is kept whole (field names, numbers, types, oneofs, maps, nested enums); options and
validation annotations are dropped, as are the files' other messages.
"""
import os
import sys
from collections import defaultdict
from google.protobuf.descriptor import FieldDescriptor as F
from envoy.service.ext_proc.v3 import external_processor_pb2 as m

PREFIX = sys.argv[1]  # the package the files go in: router/gateway/envoy_api
OUT = sys.argv[2]  # the repository root
svc = m.DESCRIPTOR.services_by_name['ExternalProcessor']
closure = {}
enums = {}
def walk(md):
    if md.full_name in closure: return
    closure[md.full_name] = md
    for f in md.fields:
        if f.message_type is not None: walk(f.message_type)
        if f.enum_type is not None: enums[f.enum_type.full_name] = f.enum_type
for meth in svc.methods:
    walk(meth.input_type); walk(meth.output_type)

SCALAR = {F.TYPE_DOUBLE: "double", F.TYPE_FLOAT: "float", F.TYPE_INT64: "int64", F.TYPE_UINT64: "uint64",
          F.TYPE_INT32: "int32", F.TYPE_FIXED64: "fixed64", F.TYPE_FIXED32: "fixed32", F.TYPE_BOOL: "bool",
          F.TYPE_STRING: "string", F.TYPE_BYTES: "bytes", F.TYPE_UINT32: "uint32", F.TYPE_SFIXED32: "sfixed32",
          F.TYPE_SFIXED64: "sfixed64", F.TYPE_SINT32: "sint32", F.TYPE_SINT64: "sint64"}

def tname(f):
    if f.message_type is not None: return "." + f.message_type.full_name
    if f.enum_type is not None: return "." + f.enum_type.full_name
    return SCALAR[f.type]

def enum_text(e, ind):
    lines = [f"{ind}enum {e.name} {{"]
    for v in e.values:
        lines.append(f"{ind}    {v.name} = {v.number};")
    lines.append(f"{ind}}}")
    return lines

def field_line(f, ind):
    mt = f.message_type
    if mt is not None and mt.GetOptions().map_entry:
        k, v = mt.fields_by_name["key"], mt.fields_by_name["value"]
        return f"{ind}map<{tname(k)}, {tname(v)}> {f.name} = {f.number};"
    label = "repeated " if f.is_repeated else ""
    if f.containing_oneof is not None and f.containing_oneof.name.startswith("_") and len(f.containing_oneof.fields) == 1:
        label = "optional "
    return f"{ind}{label}{tname(f)} {f.name} = {f.number};"

def msg_text(md, ind=""):
    lines = [f"{ind}message {md.name} {{"]
    inner = ind + "    "
    for e in md.enum_types:
        lines += enum_text(e, inner)
    for n in md.nested_types:
        if n.full_name in closure and not n.GetOptions().map_entry:
            lines += msg_text(n, inner)
    done = set()
    for f in md.fields:
        o = f.containing_oneof
        if o is not None and not (o.name.startswith("_") and len(o.fields) == 1):
            if o.name in done: continue
            done.add(o.name)
            lines.append(f"{inner}oneof {o.name} {{")
            for g in o.fields:
                lines.append(field_line(g, inner + "    "))
            lines.append(f"{inner}}}")
        else:
            lines.append(field_line(f, inner))
    lines.append(f"{ind}}}")
    return lines

by_file = defaultdict(list)
for name, md in closure.items():
    if md.containing_type is None and not md.file.name.startswith("google/"):
        by_file[md.file].append(md)
top_enums = defaultdict(list)
for e in enums.values():
    if e.containing_type is None and not e.file.name.startswith("google/"):
        top_enums[e.file].append(e)
for fd in set(by_file) | set(top_enums):
    body = []
    for e in sorted(top_enums.get(fd, []), key=lambda e: e.name):
        body += enum_text(e, "") + [""]
    for md in sorted(by_file.get(fd, []), key=lambda d: d.name):
        body += msg_text(md) + [""]
    # imports: files of every referenced type
    refs = set()
    def collect(md):
        for f in md.fields:
            t = f.message_type or f.enum_type
            if t is not None:
                if f.message_type is not None and f.message_type.GetOptions().map_entry:
                    collect(f.message_type); continue
                refs.add(t.file.name)
        for n in md.nested_types:
            if n.full_name in closure: collect(n)
    for md in by_file.get(fd, []): collect(md)
    refs.discard(fd.name)
    imports = [f'import "{r}";' if r.startswith("google/") else f'import "{PREFIX}/{r}";' for r in sorted(refs)]
    header = [f"// {fd.name} (Envoy API v3), the part of it the ext_proc service reaches.",
              "// Derived from Envoy's API (Apache-2.0) by scripts/envoy-ext-proc-protos.py: see router/gateway/envoy_api/__init__.py.",
              'syntax = "proto3";', "", f"package {fd.package};", ""] + imports + ([""] if imports else [])
    if fd.name == m.DESCRIPTOR.name:
        body += ["service ExternalProcessor {",
                 "    rpc Process(stream ProcessingRequest) returns (stream ProcessingResponse) {}", "}", ""]
    path = os.path.join(OUT, PREFIX, fd.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").write("\n".join(header + body).rstrip() + "\n")
    print(path, len(by_file.get(fd, [])), "messages")
