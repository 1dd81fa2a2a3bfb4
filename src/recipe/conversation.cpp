// Role names and content helpers of the canonical conversation.
#include "deepinfer/recipe/conversation.h"

namespace deepinfer::recipe {

std::string_view role_name(Role role) {
  switch (role) {
    case Role::kSystem: return "system";
    case Role::kDeveloper: return "developer";
    case Role::kUser: return "user";
    case Role::kAssistant: return "assistant";
    case Role::kTool: return "tool";
    case Role::kLatestReminder: return "latest_reminder";
  }
  return "unknown";
}

Result<Role> parse_role(std::string_view name) {
  for (Role role : {Role::kSystem, Role::kDeveloper, Role::kUser, Role::kAssistant, Role::kTool,
                    Role::kLatestReminder}) {
    if (role_name(role) == name) return role;
  }
  return Status::invalid_argument("unknown role '" + std::string(name) +
                                  "'; expected system, developer, user, assistant, tool or latest_reminder");
}

std::string_view v4_revision_name(V4Revision revision) {
  return revision == V4Revision::kPreview ? "preview" : "0731";
}

Result<V4Revision> parse_v4_revision(std::string_view name) {
  if (name == "0731") return V4Revision::k0731;
  if (name == "preview") return V4Revision::kPreview;
  return Status::invalid_argument("unknown deepseek-v4 format revision '" + std::string(name) +
                                  "'; expected 0731 or preview");
}

std::string Message::text(std::string_view separator) const {
  std::string out;
  bool first = true;
  for (const ContentPart& part : content) {
    if (part.kind != ContentPart::Kind::kText) continue;
    if (!first) out += separator;
    first = false;
    out += part.text;
  }
  return out;
}

bool Message::has_images() const {
  for (const ContentPart& part : content) {
    if (part.kind == ContentPart::Kind::kImage) return true;
  }
  return false;
}

}  // namespace deepinfer::recipe
