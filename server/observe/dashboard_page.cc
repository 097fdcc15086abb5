// The dashboard's pages, compiled in from server/observe/web/*.html (a header made at
// build time by server/observe/web/embed_text.cmake). Alone in this file so that
// editing a page recompiles only it.
#include <string_view>

#include "server/observe/dashboard.h"
#include "server/observe/web/dashboard_html.h"
#include "server/observe/web/dashboard_login_html.h"

namespace kvserve {

std::string_view DashboardPageHtml() { return k_dashboard_html; }
std::string_view DashboardLoginHtml() { return k_dashboard_login_html; }

}  // namespace kvserve
